# Sourced by setup.sh: link_cached_kernels SITE FIWS links every flashinfer kernel that the
# carried cache (FIWS/.cache/flashinfer/VERSION/ARCH/cached_ops/NAME/NAME.so) holds into
# flashinfer's AOT folder (SITE/flashinfer/data/aot/NAME/NAME.so), where it is loaded as is.
# Why: flashinfer 0.7 trusts a JIT-built .so only after ninja's dependency scan, and the
# carried cache leaves the object files out (save_kernel_cache), so ninja rebuilt every
# kernel on each fresh machine: 455 s for the GPU suite with the cache against about 490
# cold, and over 120 s in a stack's init_attention_backend (docs/benchmarks.md, twenty-sixth
# part). A module the AOT folder already has is left alone; one that fails to load there is
# built by JIT as before (flashinfer logs a warning).
link_cached_kernels() {
    local site=$1 fiws=$2 so name dest linked=0
    for so in "$fiws"/.cache/flashinfer/*/*/cached_ops/*/*.so; do
        [ -f "$so" ] || continue
        name=$(basename "$(dirname "$so")")
        [ "$(basename "$so")" = "$name.so" ] || continue
        dest="$site/flashinfer/data/aot/$name/$name.so"
        [ -e "$dest" ] && continue
        mkdir -p "$(dirname "$dest")"
        ln -s "$(cd "$(dirname "$so")" && pwd)/$name.so" "$dest"
        linked=$((linked + 1))
    done
    echo "flashinfer kernels linked from the carried cache: $linked"
}
