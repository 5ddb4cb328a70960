#!/bin/sh
# qtts container entrypoint: choose the model, then run the command (default `qtts serve`).
#
#   QTTS_MODEL set                     -> used as it is (qtts serve fails clearly if it is missing)
#   else $QTTS_MODELS_DIR/model.gguf   -> used (a volume you mounted at /models)
#   else the synthetic default model   -> made once, as `make run` does: a deterministic
#        random-weight model of the released architecture; its audio is NOISE, not speech.
#        It goes to $QTTS_MODELS_DIR/synthetic-<size>-<dtype>-seed0-v2/ when that folder is
#        writable (a volume keeps it across restarts), else under $QTTS_CACHE_DIR or ~/.cache.
#
# QTTS_MODELS_DIR      where to look for model.gguf (default /models)
# QTTS_SYNTHETIC_SIZE  full (default: the released 0.6B shape, a 1.5 GB Q4_0 GGUF) | tiny
set -eu

log() { printf 'qtts-entrypoint: %s\n' "$*" >&2; }

[ "$#" -gt 0 ] || set -- qtts serve

if [ -z "${QTTS_MODEL:-}" ]; then
    models_dir="${QTTS_MODELS_DIR:-/models}"
    if [ -f "$models_dir/model.gguf" ]; then
        QTTS_MODEL="$models_dir/model.gguf"
    else
        size="${QTTS_SYNTHETIC_SIZE:-full}"
        case "$size" in
            full) dtype=q4_0 ;;
            tiny) dtype=f32 ;;
            *) log "QTTS_SYNTHETIC_SIZE must be full or tiny, not '$size'"; exit 2 ;;
        esac
        if [ -d "$models_dir" ] && [ -w "$models_dir" ]; then
            base="$models_dir"
        else
            base="${QTTS_CACHE_DIR:-${HOME:-/tmp}/.cache/qtts}/models"
        fi
        dir="$base/synthetic-$size-$dtype-seed0-v2"  # v2: real text vocabulary, F32 decoder
        if [ ! -f "$dir/model.gguf" ]; then
            log "no model given (QTTS_MODEL unset, no $models_dir/model.gguf): making the" \
                "synthetic $size model in $dir -- its audio is NOISE, not speech"
            mkdir -p "$base"
            tmp="$(mktemp -d "$base/.synthetic.XXXXXX")"
            if ! qtts make-model "$tmp" --size "$size" --dtype "$dtype" --seed 0 --no-progress; then
                rm -rf "$tmp"
                log "making the synthetic model failed"
                exit 1
            fi
            mkdir -p "$dir"
            # made aside, then renamed: a rename within one file system is atomic, so a
            # concurrent start sees all or none
            mv "$tmp/model.gguf" "$dir/model.gguf"
            rm -rf "$tmp"
        fi
        QTTS_MODEL="$dir/model.gguf"
    fi
    export QTTS_MODEL
fi
log "model: $QTTS_MODEL"
exec "$@"
