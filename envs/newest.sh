#!/usr/bin/env bash
# The suite on the newest JAX: a Debian 13 root (Python 3.13) under .newest/, built once and
# reused, where pip resolves today's jax/jaxlib/libtpu, flax, optax, orbax-checkpoint, chex, grain
# and tensorflow-datasets (this machine's Python 3.11 stops at jax 0.10). Needs root (debootstrap,
# chroot, mounts); the mounts live in a private mount namespace and vanish with it.
#
#   envs/newest.sh            build or reuse the root, then install, test, demo and compile there
#   NEWEST_DIR=/elsewhere     where the root is kept (default: .newest in the checkout)
#   DEBIAN_MIRROR=URL         the Debian mirror debootstrap uses (default: its own)
#   NEWEST_PART=compare-torch after the install, benchmarks/compare_torch.py there instead of the
#                             suite, against PyTorch from envs/torch-peer-py313.txt (its own
#                             directory in the root); the JSON comes back as
#                             benchmarks/results/compare_torch_cpu_newest.json
#   NEWEST_COMPARE_ARGS="..." compare_torch.py's arguments there (e.g. "--rows sdpa_1024 --quick")
#   NEWEST_DEMO_ARGS="..."    demo.py's arguments there (default: a few steps per stage; "" for
#                             the full demo)
set -euo pipefail
cd "$(dirname "$0")/.."
CHECKOUT=$PWD
CACHE=${NEWEST_DIR:-$CHECKOUT/.newest}
ROOT=$CACHE/root

build_root() {
    command -v debootstrap > /dev/null || { apt-get update -qq && apt-get install -y -qq debootstrap; }
    local partial=$CACHE/root.partial
    # A build killed half-way may have left its own mounts in the partial root: unmount them
    # before deleting, and never delete across a file-system boundary.
    if [ -e "$partial" ]; then
        findmnt -rn -o TARGET | grep -F "$partial/" | sort -r | xargs -r -n1 umount -l || true
        rm -rf --one-file-system "$partial"
    fi
    mkdir -p "$CACHE"
    echo "newest: building a Debian 13 root in $ROOT (about a minute)"
    debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
        trixie "$partial" ${DEBIAN_MIRROR:-} > "$CACHE/debootstrap.log" 2>&1 \
        || { tail -20 "$CACHE/debootstrap.log"; exit 1; }
    mv "$partial" "$ROOT"
}

[ -x "$ROOT/usr/bin/python3" ] || build_root

# What the root needs from this machine each run: its CA certificates (pip goes through the
# same TLS path as here), name resolution, and the hostname (gloo's two-process tests).
cp /usr/local/share/ca-certificates/*.crt "$ROOT/usr/local/share/ca-certificates/" 2>/dev/null || true
cp -L /etc/resolv.conf /etc/hosts "$ROOT/etc/"
# The checkout as committed plus untracked files git does not ignore, copied fresh: nothing the
# root writes (bytecode, build/, caches) lands in the checkout.
rm -rf --one-file-system "$ROOT/src"
mkdir -p "$ROOT/src"
git ls-files -z --cached --others --exclude-standard \
    | tar --null --ignore-failed-read -T - -cf - 2> /dev/null | tar -xf - -C "$ROOT/src"

unshare --mount --propagation private bash -c '
    set -e
    ROOT=$1
    mount -t proc proc "$ROOT/proc"
    mount --rbind /dev "$ROOT/dev"
    mount --rbind /sys "$ROOT/sys"  # libtpu reads it and aborts without it
    exec chroot "$ROOT" env -i HOME=/root TERM=dumb LANG=C.UTF-8 \
        PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_DISABLE_PIP_VERSION_CHECK=1 \
        PIP_DEFAULT_TIMEOUT=180 CI="${CI:-}" NEWEST_PART="${NEWEST_PART:-suite}" \
        ${NEWEST_COMPARE_ARGS+NEWEST_COMPARE_ARGS="$NEWEST_COMPARE_ARGS"} ${NEWEST_DEMO_ARGS+NEWEST_DEMO_ARGS="$NEWEST_DEMO_ARGS"} \
        bash /src/envs/newest_inside.sh
' newest "$ROOT"
if [ "${NEWEST_PART:-suite}" = compare-torch ]; then
    cp "$ROOT/src/benchmarks/results/compare_torch_cpu_newest.json" benchmarks/results/
    echo "newest: benchmarks/results/compare_torch_cpu_newest.json"
fi
