from gpunet_exporter.cli import main

main()
