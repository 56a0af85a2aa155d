#!/usr/bin/env bash
# Installs the Debian packages hora's launcher tests start for real: OpenSSH (a server per
# network-namespace "host"), iproute2 (namespaces, veth pairs), nftables and iptables (a
# blocked port for `horarun doctor`), Open MPI and MPICH (mpirun / mpiexec.mpich and the
# headers mpi4py builds against), Slurm and munge (a one-machine cluster for srun), and a Java
# runtime for PySpark's executors (hora.spark's tests).
#
# Idempotent and fast when everything is there: it asks dpkg first and runs apt-get only
# for what is missing. Needs root (CI runs as root); without root it says so and exits 1.
set -euo pipefail

PACKAGES=(
    openssh-server openssh-client iproute2 nftables iptables procps
    openmpi-bin libopenmpi-dev mpich libmpich-dev
    slurm-wlm slurmctld slurmd slurm-client munge
    openjdk-17-jre-headless
)

# dpkg-query exits 1 when some package is unknown to dpkg (never installed on this machine),
# which pipefail would turn into a silent exit: only its output matters here.
installed=$({ dpkg-query -W -f='${Package} ${Status}\n' "${PACKAGES[@]}" 2>/dev/null || true; } |
    awk '$4 == "installed" {print $1}')
missing=()
for package in "${PACKAGES[@]}"; do
    if ! grep -qx "$package" <<<"$installed"; then
        missing+=("$package")
    fi
done
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "scripts/setup-system.sh: run as root to install: ${missing[*]}" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
# Services the packages would start at install time are not wanted: the tests start their own.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod +x "$policy"
    created_policy=1
fi
log=$(mktemp)
trap '[ "$created_policy" = 1 ] && rm -f "$policy"; rm -f "$log"' EXIT
if ! { apt-get update -q -o Dpkg::Use-Pty=0 &&
       apt-get install -y -q --no-install-recommends -o Dpkg::Use-Pty=0 "${missing[@]}"; } >"$log" 2>&1; then
    tail -n 30 "$log" >&2
    echo "scripts/setup-system.sh: apt-get could not install: ${missing[*]}" >&2
    exit 1
fi
echo "scripts/setup-system.sh: installed ${missing[*]}"
