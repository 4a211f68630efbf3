"""The decoding core: a method is a drafting policy plus an acceptance rule (methods.py), run by
one of two loops behind one slot API (slots.py: `SlotDecoder`): `Decoder` for every method that
commits in raster order, `PublishedPJD` for pjd's released loop, which commits out of it."""

from runtime.core.decoder import Decoder
from runtime.core.slots import ImageStats, RunStats, SlotDecoder
from runtime.core.generate import GenerationResult, generate, neighbours_for
from runtime.core.methods import METHODS, MethodSpec
from runtime.core.sampling import SamplingParams

__all__ = ["Decoder", "GenerationResult", "ImageStats", "METHODS", "MethodSpec", "RunStats",
           "SamplingParams", "SlotDecoder", "generate", "neighbours_for"]
