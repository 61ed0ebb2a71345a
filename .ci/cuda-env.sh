# shellcheck shell=bash
# Installs NVRTC and the CUDA headers from pip (once, into a local prefix; no GPU or driver needed)
# and exports what kvq looks for:
#   LD_LIBRARY_PATH   += the folder holding libnvrtc.so.13 (cudarc loads it through the dynamic loader)
#   KVQ_CUDA_INCLUDE  =  colon-separated include folders (CUDA headers, then CCCL's for <nv/target>)
#   KVQ_REQUIRE_NVRTC =  1, so NVRTC tests fail instead of skipping when the library is unusable
#
# Source it, in CI or a developer shell:   source .ci/cuda-env.sh
# KVQ_CUDA_PREFIX overrides where the wheels go.

kvq_cuda_env() {
    local version="13.0"
    local prefix="${KVQ_CUDA_PREFIX:-${XDG_CACHE_HOME:-$HOME/.cache}/kvq-ci/cuda}"
    local lib inc
    if [ "$(cat "$prefix/.complete" 2>/dev/null)" != "$version" ]; then
        echo "cuda-env: installing NVRTC $version and CUDA headers from PyPI into $prefix" >&2
        # `pip --target` does not merge into an existing `nvidia/` folder, so install every wheel in one
        # call into a fresh folder and move it into place only when complete.
        local tmp="$prefix.partial"
        rm -rf "$tmp"
        mkdir -p "$(dirname "$prefix")"
        PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check \
            --no-warn-script-location --target "$tmp" \
            "nvidia-cuda-nvrtc==$version.*" "nvidia-cuda-runtime==$version.*" "nvidia-cuda-cccl==$version.*" ||
            { echo "cuda-env: pip install failed" >&2; return 1; }
        rm -rf "$prefix"
        mv "$tmp" "$prefix" && echo "$version" >"$prefix/.complete" || return 1
    fi
    lib="$(find "$prefix" -name 'libnvrtc.so.13' -print -quit)"
    inc="$(find "$prefix" -name 'cuda_fp16.h' -not -path '*/cccl/*' -print -quit)"
    if [ -z "$lib" ] || [ -z "$inc" ]; then
        echo "cuda-env: $prefix lacks libnvrtc.so.13 or cuda_fp16.h; delete it and source this again" >&2
        return 1
    fi
    lib="$(dirname "$lib")"
    inc="$(dirname "$inc")"
    # CUDA 13's cuda_fp16.hpp includes <nv/target>, which CCCL ships under include/cccl.
    if [ -d "$inc/cccl" ]; then
        inc="$inc:$inc/cccl"
    fi
    case ":${LD_LIBRARY_PATH:-}:" in
        *":$lib:"*) ;;
        *) export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
    esac
    export KVQ_CUDA_INCLUDE="$inc"
    export KVQ_REQUIRE_NVRTC=1
    echo "cuda-env: libnvrtc in $lib; KVQ_CUDA_INCLUDE=$KVQ_CUDA_INCLUDE" >&2
}

kvq_cuda_env
