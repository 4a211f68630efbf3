"""The decoding core: one loop shared by AR, chain SD, EAGLE-2, LANTERN and LANTERN++."""

from runtime.core.decoder import Decoder, ImageStats, RunStats
from runtime.core.generate import GenerationResult, generate, neighbours_for
from runtime.core.methods import METHODS, MethodSpec
from runtime.core.sampling import SamplingParams

__all__ = ["Decoder", "GenerationResult", "ImageStats", "METHODS", "MethodSpec", "RunStats",
           "SamplingParams", "generate", "neighbours_for"]
