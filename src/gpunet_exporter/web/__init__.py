"""The web face: the HTTP server, the WSGI app that serves /metrics, TLS and basic auth."""
