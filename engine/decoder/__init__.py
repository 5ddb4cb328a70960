"""Speech-tokenizer decoder on ggml: codes [16, T] -> 24 kHz audio, offline and streaming.

Stages, one module each: ``rvq`` -> ``pre_conv`` -> ``pre_transformer`` -> ``upsample`` ->
``bigvgan``; ``model`` holds the loaded weights and ``streaming`` drives the stages with carried
state. The math of each stage: docs/architecture.md, Decoder stages.
"""

from engine.decoder.model import DecoderModel
from engine.decoder.streaming import StreamingDecoder, decode, push_together, validate_codes
from engine.timings import StageTimings

__all__ = ["DecoderModel", "StageTimings", "StreamingDecoder", "decode", "push_together",
           "validate_codes"]
