"""lantern-runtime: visual autoregressive generation with LANTERN++ speculative decoding.

    from runtime import ImageGenerator
    images = ImageGenerator().generate(num_images=2).images

`ImageGenerator` (runtime/generation/generator.py) is imported on first use, so `import runtime`
(and `runtime --help`) loads no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["GeneratedImage", "Generation", "ImageGenerator", "UserError", "__version__"]

if TYPE_CHECKING:
    from runtime.generation.generator import GeneratedImage, Generation, ImageGenerator
    from runtime.utils.errors import UserError


def __getattr__(name: str) -> Any:
    if name in ("GeneratedImage", "Generation", "ImageGenerator"):
        from runtime.generation import generator

        return getattr(generator, name)
    if name == "UserError":
        from runtime.utils.errors import UserError

        return UserError
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
