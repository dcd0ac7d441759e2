#!/usr/bin/env bash
# The whole test suite, from a fresh machine: Debian packages (when root), a virtualenv with the
# exporter and its test dependencies, lint, types, then pytest, its tests spread over
# pytest-xdist workers (GPUNET_TEST_WORKERS, default 4: most system tests wait on processes;
# tests/support/tiers.py keeps the tests of a module's shared fixture on one worker).
# Extra arguments go to pytest (`-n 0`: one process, in order).
#
# `bash tests/run.sh --unit [pytest arguments]`: the unit tier only (tests/support/tiers.py):
# no Debian package installed or needed, the same virtualenv, lint and types, then
# `pytest -m unit` (a `-m EXPR` given is joined to it: `-m 'unit and (EXPR)'`).
set -euo pipefail
cd "$(dirname "$0")/.."

unit=
if [ "${1:-}" = --unit ]; then unit=1; shift; fi

need_apt=()
command -v prometheus >/dev/null || need_apt+=(prometheus)
command -v promtool >/dev/null || need_apt+=(prometheus)
command -v prometheus-node-exporter >/dev/null || need_apt+=(prometheus-node-exporter)
command -v prometheus-alertmanager >/dev/null || need_apt+=(prometheus-alertmanager)
command -v ip >/dev/null || need_apt+=(iproute2)          # network namespaces (pfc tests)
command -v ethtool >/dev/null || need_apt+=(ethtool)      # ioctl results checked against it
command -v systemd-analyze >/dev/null || need_apt+=(systemd)  # verify/security of the unit
command -v udevadm >/dev/null || need_apt+=(udev)  # udevadm test of the umad rule
# A real Slurm of namespace nodes for slurm/gpunet-fleet.sbatch (tests/support/slurm.py)
command -v slurmctld >/dev/null || need_apt+=(slurmctld)
command -v slurmd >/dev/null || need_apt+=(slurmd)
command -v sbatch >/dev/null || need_apt+=(slurm-client)
command -v munged >/dev/null || need_apt+=(munge)
# A simulated InfiniBand fabric for the fabric collector (tests/support/ibsim.py)
command -v ibsim >/dev/null || need_apt+=(ibsim-utils)
command -v opensm >/dev/null || need_apt+=(opensm)
command -v ibnetdiscover >/dev/null || need_apt+=(infiniband-diags)
python3 -c 'import ensurepip' 2>/dev/null || need_apt+=(python3-venv)
# The container image (tests/test_image.py): a Debian root filesystem as its base, built with
# buildah, run with podman through runc (crun refuses hosts with cgroups v1 and v2 at once)
command -v mmdebstrap >/dev/null || need_apt+=(mmdebstrap)
command -v buildah >/dev/null || need_apt+=(buildah)
command -v podman >/dev/null || need_apt+=(podman)
command -v runc >/dev/null || need_apt+=(runc)
if [ -n "$unit" ]; then
  :  # the unit tier needs none of them
elif ((${#need_apt[@]})); then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "run.sh: installing Debian packages: ${need_apt[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${need_apt[@]}" >/dev/null
    # The packages start their services where systemd runs; the tests start their own.
  else
    echo "run.sh: missing Debian packages (${need_apt[*]}); run as root to install them," \
         "or the tests that need them will fail" >&2
  fi
fi

venv=.venv
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip >/dev/null
# probe: torch==2.13.0, CPU build, gloo tests. --no-compile: the modules the tests import are
# compiled once, when first imported (below), not every module of every package at install
# (a fresh virtualenv: 25 s instead of 34 s).
"$venv/bin/pip" install -q --no-compile ".[test,probe]"
export PATH="$PWD/$venv/bin:$PATH"
# Bytecode is written, whatever the caller's PYTHONDONTWRITEBYTECODE says: the modules above,
# and pytest's rewriting of the test modules' asserts (__pycache__/, ignored by git), which
# every worker and phase would otherwise redo (6 s of CPU each).
unset PYTHONDONTWRITEBYTECODE

echo "run.sh: ruff"; python -m ruff check src tests bench grafana examples kubernetes \
  slurm/gpunet-healthcheck
echo "run.sh: mypy"; python -m mypy
# The tests' temporary files (pytest's --basetemp) in memory where /dev/shm is a tmpfs with room
# and 8 GiB of memory are available (the container image's store takes 2.4 GB; GPUNET_TEST_TMP
# names another folder, empty: pytest's default under /tmp): many tests build and remove sysfs
# trees of thousands of small files, ten times faster there than on a busy disk.
tmp_root="${GPUNET_TEST_TMP-/dev/shm}"
gib=$((1024 * 1024))  # in KiB
basetemp=()
if [ -n "$tmp_root" ] && [ -d "$tmp_root" ] && [ -w "$tmp_root" ] \
    && (($(df -Pk "$tmp_root" | awk 'NR == 2 {print $4}') > 8 * gib)) \
    && { [ "$(stat -f -c %T "$tmp_root")" != tmpfs ] \
         || (($(awk '/^MemAvailable:/ {print $2}' /proc/meminfo) > 8 * gib)); }; then
  # Short: podman refuses a --runroot (tests/test_image.py's, under it) past 50 characters.
  base="$(mktemp -d "$tmp_root/gpunet.XXXXXX")"
  trap 'rm -rf "$base"' EXIT
  basetemp=(--basetemp "$base")
fi
# `-m EXPR` (or `-mEXPR`) given: combined with the tier's or the phase's own marker below.
args=() user=""
while (($#)); do
  case "$1" in
    -m) user="$2"; shift 2 ;;
    -m?*) user="${1#-m}"; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
with() { echo "$1${user:+ and ($user)}"; }
if [ -z "$unit" ]; then
  # Two parts: everything but the quiet tests on the workers, then the quiet ones (bandwidth
  # and timing measurements, tests/support/tiers.py QUIET_MODULES) on two workers, the
  # namespace fleets one after the other on one of them.
  # Exit code 5 (no test selected: a file argument without quiet tests) is no failure.
  echo "run.sh: pytest -m '$(with "not quiet")'"
  rc=0
  python -m pytest -n "${GPUNET_TEST_WORKERS:-4}" -m "$(with "not quiet")" "${basetemp[@]}" \
    ${args[@]+"${args[@]}"} || rc=$?
  ((rc == 5)) && rc=0
  echo "run.sh: pytest -m '$(with quiet)' (the fleets alone)"
  qrc=0
  python -m pytest -n 2 -m "$(with quiet)" "${basetemp[@]}" ${args[@]+"${args[@]}"} \
    || qrc=$?
  ((qrc == 5)) && qrc=0
  ((rc)) && exit "$rc"
  exit "$qrc"
fi
# The unit tier: `-m unit`, or `-m 'unit and (EXPR)'` for a `-m EXPR` given.
marks="$(with unit)"
echo "run.sh: pytest -m '$marks'"
python -m pytest -n "${GPUNET_TEST_WORKERS:-2}" -m "$marks" "${basetemp[@]}" \
  ${args[@]+"${args[@]}"} && exit 0 || exit $?
