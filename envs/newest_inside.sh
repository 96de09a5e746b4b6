#!/usr/bin/env bash
# Runs inside the Debian 13 root that envs/newest.sh prepares, on its copy of the checkout at
# /src: the newest JAX stack installed first, as a user's environment would hold it, then attnjax
# on top of it without a constraints file, then the suite, the demo and a TPU compile.
set -euo pipefail
update-ca-certificates > /dev/null 2>&1
VENV=/opt/venv
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY=$VENV/bin/python
PIP="$PY -m pip --quiet"
$PIP install --upgrade pip setuptools wheel  # setuptools: tests/test_packaging.py builds attnjax offline

# The user's environment: the newest release of each library attnjax builds on.
$PIP install --upgrade "jax[tpu]" flax optax orbax-checkpoint chex grain tensorflow-datasets
installed_jax() { $PY -c 'import importlib.metadata as m; print(m.version("jax"), m.version("jaxlib"))'; }
before=$(installed_jax)
# attnjax and its test tools (pinned as in the dev environment), no constraint on the JAX stack:
# the declared ranges must accept what the user has.
$PIP install -c /src/envs/tools.txt "/src[test]"
after=$(installed_jax)
if [ "$before" != "$after" ]; then
    echo "newest: installing attnjax replaced jax/jaxlib $before with $after" >&2
    exit 1
fi
echo "newest: attnjax installed beside jax/jaxlib $after, left in place"

cd /src
if [ "$NEWEST_PART" = compare-torch ]; then
    # PyTorch in a directory of its own, on the path of this one command: the suite's environment
    # stays without it, as a user's JAX install would be.
    PEER=/opt/torch-peer
    if ! cmp -s envs/torch-peer-py313.txt "$PEER/.requirements"; then
        rm -rf "$PEER"
        $PIP install --no-deps --no-compile --target "$PEER" -r envs/torch-peer-py313.txt
        cp envs/torch-peer-py313.txt "$PEER/.requirements"
    fi
    echo "== newest: benchmarks/compare_torch.py ${NEWEST_COMPARE_ARGS:-}"
    # shellcheck disable=SC2086  # the arguments split on spaces
    PYTHONPATH=$PEER exec $PY benchmarks/compare_torch.py \
        --out benchmarks/results/compare_torch_cpu_newest.json ${NEWEST_COMPARE_ARGS:-}
fi
export JAX_COMPILATION_CACHE_DIR=/root/.jax_cache
# Each part runs even when one before it failed (all three are reported); any failure fails.
status=0
echo "== newest: the suite (the tests that need no PyTorch: this environment has none, as a user's JAX install would)"
$PY -m pytest -n 2 --dist loadgroup -m "not cuda" -p no:cacheprovider tests || status=1
# The demo's whole pipeline with a few steps per stage (the full demo took 401 s of CI's 40
# minutes on a 2-core VM; its table there: NEWEST_DEMO_ARGS="" envs/newest.sh).
DEMO_ARGS=${NEWEST_DEMO_ARGS-"--train_steps 40 --samples_per_class 5 --completions 20"}
echo "== newest: demo.py $DEMO_ARGS"
rm -rf /tmp/demo
# shellcheck disable=SC2086  # the arguments split on spaces
$PY demo.py --workdir /tmp/demo $DEMO_ARGS || status=1
echo "== newest: python -m attnjax.compile --config configs/vit_digits.py --target tpu:v5e:2x4"
$PY -m attnjax.compile --config configs/vit_digits.py --target tpu:v5e:2x4 || status=1
exit $status
