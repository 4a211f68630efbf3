"""The backend and hardware profile a command runs with (torch-free until called: `runtime
--help` imports no torch)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.generation.loading import LoadedModel
    from runtime.generation.source import ModelSource

_log = logging.getLogger("runtime.cli")


def open_backend(device: str, profile_name: str | None, graph: bool | None, dtype: str | None,
                 index: int | None = None) -> tuple[Any, Any]:
    """(backend, profile): the backend for --device and the profile for it (or --profile-name)."""
    from backends import get_backend
    from runtime.config.profiles import default_profile_for, load_profile

    given = load_profile(profile_name) if profile_name else None
    # Gaudi's lazy/eager mode is fixed when habana_frameworks is first imported, which probing
    # does: choose it from the profile (gaudi2 is the only HPU profile) before probing.
    lazy = (given or load_profile("gaudi2")).device.hpu_lazy_mode if device in ("hpu", "auto") else None
    probe = get_backend(device, graph_mode=False, index=index, hpu_lazy_mode=lazy)
    profile = given or default_profile_for(probe.name, str(probe.info().get("name", "")))
    graph_mode = profile.device.graph if graph is None else graph
    backend = get_backend(probe.name, dtype=dtype or profile.device.dtype, graph_mode=graph_mode,
                          index=index, hpu_lazy_mode=profile.device.hpu_lazy_mode)
    _log.info("device %s (%s), profile %s (%s), graph mode %s, dtype %s", backend.name,
                                          probe.info().get("name", "?"), profile.name, profile.source,
                                          "on" if graph_mode else "off", dtype or profile.device.dtype)
    return backend, profile


def open_model(source: ModelSource, device: str, profile_name: str | None, graph: bool | None, dtype: str | None,
               index: int | None = None) -> tuple[Any, Any, LoadedModel]:
    """(backend, profile, the model loaded on it): what every command and the `ImageGenerator`
    open first, before any setting is resolved."""
    backend, profile = open_backend(device, profile_name, graph, dtype, index=index)
    return backend, profile, source.load(backend)
