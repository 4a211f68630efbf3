"""Where a model comes from: the model options as given, one value (torch-free: the CLI builds it
before anything loads)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from backends import Backend
    from runtime.generation.loading import LoadedModel


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: the model options as given (the CLI's `MODEL_OPTIONS`)."""

    model: str | None = None
    model_revision: str | None = None
    gpt_model: str | None = None
    gpt_ckpt: str | None = None
    gpt_type: str = "c2i"
    vq_ckpt: str | None = None
    image_size: int | None = None
    drafter: str | None = None
    trust_checkpoint: bool = False

    @classmethod
    def pick(cls, params: dict[str, Any]) -> "ModelSource":
        """The model options out of a command's parameters (`runtime sample` takes run's)."""
        return cls(**{f.name: params[f.name] for f in fields(cls)})

    def load(self, backend: Backend) -> LoadedModel:
        """The model on the backend's device and dtype (`runtime.generation.loading.load_model`)."""
        from runtime.generation.loading import load_model

        return load_model(model=self.model, gpt_model=self.gpt_model, gpt_ckpt=self.gpt_ckpt, vq_ckpt=self.vq_ckpt,
                          image_size=self.image_size, drafter=self.drafter, gpt_type=self.gpt_type,
                          trust=self.trust_checkpoint, device=backend.device, dtype=backend.dtype,
                          revision=self.model_revision, device_free=backend.free_memory())
