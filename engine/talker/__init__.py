"""Talker LLM, code predictor, KV cache, sampling, and the text prompt.

Math: docs/architecture.md, Talker and code predictor.

Public names: ``TalkerModel`` (weights + graphs), ``PromptBuilder`` / ``Prompt`` (text side),
``VoiceCatalog`` (voices, languages, instructions a request may ask for),
``SamplingParams`` (sampling settings), ``generate_frames`` / ``frame_budget`` (the frame loop).
"""

from engine.talker.generate import (
    OUTCOMES,
    Frame,
    Outcome,
    Result,
    Trace,
    frame_budget,
    generate_frames,
)
from engine.talker.model import KV_TYPES, PrefillOut, TalkerModel
from engine.talker.prompt import TEXT_MODES, Prompt, PromptBuilder, TextMode
from engine.talker.sampling import SamplingParams, make_rng
from engine.talker.voices import VoiceCatalog, instruct_supported

__all__ = [
    "KV_TYPES",
    "OUTCOMES",
    "TEXT_MODES",
    "Frame",
    "Outcome",
    "PrefillOut",
    "Prompt",
    "PromptBuilder",
    "Result",
    "SamplingParams",
    "TalkerModel",
    "TextMode",
    "Trace",
    "VoiceCatalog",
    "frame_budget",
    "generate_frames",
    "instruct_supported",
    "make_rng",
]
