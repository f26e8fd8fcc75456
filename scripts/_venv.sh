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

# LMCache (for tests/test_lmcache.py). Its declared requirements pull a CUDA stack (cupy, cuda-python) and
# downgrade numpy and fastapi, so it goes in without them, followed by what it really imports on a CPU.
LMCACHE_VERSION=0.5.6
ensure_lmcache() {
    local stamp="$VENV/.ctxstore-lmcache-$LMCACHE_VERSION"
    [ -f "$stamp" ] && return 0
    if "$VENV/bin/python" -m pip install --quiet --no-deps "lmcache==$LMCACHE_VERSION" \
        && "$VENV/bin/python" -m pip install --quiet py-cpuinfo psutil msgspec blake3 aiofile aiofiles caio \
            cachetools numba; then
        touch "$stamp"
    else
        echo "scripts/test: LMCache $LMCACHE_VERSION could not be installed; tests/test_lmcache.py will skip" >&2
    fi
}
