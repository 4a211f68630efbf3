"""FID, Inception Score, KID and precision/recall through torch-fidelity, with bootstrap intervals.

Features come from torch-fidelity's InceptionV3 (`inception-v3-compat`: ported from the TF
graph that ADM's evaluator and the original FID code use; pool_3 2048-d features for FID, KID
and precision/recall, the unbiased 1008-way logits for IS). The weights are a local file read
by the project's safe checkpoint loader; nothing is downloaded. sFID (spatial features) is not
in torch-fidelity and is not computed.

Each figure is computed on the whole generated set; its 95% interval is the 2.5 / 97.5
percentiles of the same figure recomputed on `reps` resamples (with replacement) of the generated
images, the reference held fixed, or, when the reference is a run of the same workload (image i
of both has the same seed and condition), resampling the same indices of both (paired). A
resample repeats images, which biases FID and KID upward a little: read the interval as the
spread of the estimate, the point value as the estimate.

Needs the `eval` extra (`torch-fidelity`, which needs a `torchvision` matching the installed torch).
"""

from __future__ import annotations

import io

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runtime.utils.errors import UserError
from runtime.metrics import INCEPTION_ENV
from runtime.metrics.images import ImageSet
from runtime.metrics.intervals import Estimate, bootstrap

INCEPTION_FILE = "weights-inception-2015-12-05-6726825d.pth"
INCEPTION_URL = f"https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/{INCEPTION_FILE}"
INSTALL_HINT = ("install the eval extra: pip install 'lantern-runtime[eval]' (torch-fidelity; it needs the "
                "torchvision built for your torch, from the same PyTorch index)")
FEATURES = ("2048", "logits_unbiased")


def require_torch_fidelity() -> Any:
    """The torch_fidelity module, or one UserError naming the extra (or the torch / torchvision
    pair) to install."""
    try:
        import torch_fidelity
    except ImportError as err:
        raise UserError(f"FID / IS / KID / precision-recall need torch-fidelity ({err}); {INSTALL_HINT}") from None
    except (RuntimeError, AttributeError, OSError) as err:  # a torchvision built for another torch
        raise UserError(torchvision_mismatch("torch-fidelity", err)) from None
    return torch_fidelity


def torchvision_mismatch(package: str, err: BaseException) -> str:
    """The line for `package` failing to import because torchvision does not fit the installed torch
    (torchvision's compiled operators are registered against one torch release: `operator
    torchvision::nms does not exist`). torch 2.N pairs with torchvision 0.(N+15)."""
    from importlib import metadata

    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    try:
        vision = metadata.version("torchvision")
    except metadata.PackageNotFoundError:
        vision = "(not found)"
    release = torch.__version__.split("+")[0]
    major, minor = (int(x) for x in release.split(".")[:2])
    pair = f"torchvision 0.{minor + 15}.x" if major == 2 else "the torchvision release made for it"
    index = "https://download.pytorch.org/whl/cpu" if torch.version.cuda is None else "your CUDA's PyTorch index"
    return (f"{package} could not import torchvision ({first}): torchvision {vision} is not the build for torch "
            f"{torch.__version__}, which pairs with {pair}; install the pair from one index, e.g. pip install "
            f"'torch=={release}' 'torchvision==0.{minor + 15}.*' --index-url {index} (docs/quality.md, Install)")


def inception_weights(path: str | None) -> Path:
    """The InceptionV3 weights file: `path`, else $LANTERN_INCEPTION_WEIGHTS; refused if absent."""
    chosen = path or os.environ.get(INCEPTION_ENV)
    if not chosen:
        raise UserError(f"FID / IS / KID / precision-recall need InceptionV3 weights: download {INCEPTION_URL} "
                        f"beforehand and pass --inception-weights PATH (or set {INCEPTION_ENV})")
    file = Path(chosen)
    if not file.is_file():
        raise UserError(f"--inception-weights {chosen}: file not found; download {INCEPTION_URL} there")
    return file


def load_inception(path: Path, *, trust: bool = False, device: torch.device | str = "cpu") -> torch.nn.Module:
    """torch-fidelity's InceptionV3 feature extractor with the weights in `path`.

    The file is read by the safe loader (safetensors, or a pickle of tensors only unless `trust`).
    torch-fidelity's constructor itself unpickles whatever path it is given with
    `weights_only=False`, so it is handed a private file holding just the tensors read here.
    """
    from runtime.models.loading import read_checkpoint

    state = read_checkpoint(path, trust=trust)
    for key, tensor in state.items():  # NaN weights give NaN features, and every figure from them is NaN
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise UserError(f"{path}: {key!r} holds {bad} NaN or infinite values; the weights are corrupt "
                            f"(download {INCEPTION_FILE} again from {INCEPTION_URL})")
    require_torch_fidelity()
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    try:
        model = FeatureExtractorInceptionV3("inception-v3-compat", list(FEATURES),
                                            feature_extractor_weights_path=_in_memory(state))
    except RuntimeError as err:  # load_state_dict: missing / unexpected keys, wrong shapes
        first = str(err).strip().splitlines()[0]
        raise UserError(f"{path} is not torch-fidelity InceptionV3 weights ({first}); use {INCEPTION_FILE} "
                        f"from {INCEPTION_URL}") from None
    return model.to(device)


def _in_memory(state: dict[str, torch.Tensor]) -> Any:
    """`state` as a torch.save file in memory: torch-fidelity hands its weights path to
    torch.load, which reads a file object as well, so nothing is written to the temp folder (a
    full one would fail inside torch's writer)."""
    buffer = io.BytesIO()
    torch.save({k: v.contiguous() for k, v in state.items()}, buffer)
    buffer.seek(0)
    return buffer


@dataclass
class InceptionFeatures:
    """pool: (N, 2048) float64 pool_3 features; logits: (N, 1008) float64 unbiased logits."""

    pool: np.ndarray
    logits: np.ndarray

    def __len__(self) -> int:
        return len(self.pool)

    def check(self, what: str) -> "InceptionFeatures":
        """Refuse features that hold NaN or inf (every figure from them would be NaN); returns self."""
        for name, array in (("pool_3 features", self.pool), ("logits", self.logits)):
            if not np.isfinite(array).all():
                rows = int((~np.isfinite(array)).any(axis=1).sum())
                raise UserError(f"{what}: the Inception {name} of {rows} of {len(array)} images are NaN or infinite; "
                                "no figure was computed (check the weights file and the images)")
        return self


@torch.no_grad()
def extract(model: torch.nn.Module, images: ImageSet, *, batch_size: int = 64,
            on_batch: Any = None) -> InceptionFeatures:
    """Inception features of every image in `images`, in order. `on_batch(n)` after each batch."""
    device = next(model.parameters()).device
    pools, logits = [], []
    for batch in images.batches(batch_size):
        x = torch.from_numpy(np.ascontiguousarray(batch)).permute(0, 3, 1, 2).to(device)
        pool, logit = model(x)
        pools.append(pool.double().cpu().numpy())
        logits.append(logit.double().cpu().numpy())
        if on_batch is not None:
            on_batch(len(batch))
    return InceptionFeatures(np.concatenate(pools), np.concatenate(logits))


def gaussian(pool: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mu (F,), sigma (F, F)) of features (N, F), as torch-fidelity computes them."""
    return pool.mean(0), np.cov(pool, rowvar=False)


def fid(stats_a: tuple[np.ndarray, np.ndarray], stats_b: tuple[np.ndarray, np.ndarray]) -> float:
    """torch-fidelity's Frechet distance between two Gaussians (mu, sigma)."""
    from torch_fidelity.metric_fid import KEY_METRIC_FID, fid_statistics_to_metric

    a = {"mu": stats_a[0].astype(np.float64), "sigma": stats_a[1].astype(np.float64)}
    b = {"mu": stats_b[0].astype(np.float64), "sigma": stats_b[1].astype(np.float64)}
    return float(fid_statistics_to_metric(a, b, verbose=False)[KEY_METRIC_FID])


def inception_score(logits: np.ndarray) -> float:
    from torch_fidelity.metric_isc import KEY_METRIC_ISC_MEAN, isc_features_to_metric

    splits = max(1, min(10, len(logits) // 2))
    return float(isc_features_to_metric(torch.from_numpy(logits), splits=splits)[KEY_METRIC_ISC_MEAN])


def kid(gen: np.ndarray, ref: np.ndarray, subsets: int = 100, seed: int = 2020) -> float:
    from torch_fidelity.metric_kid import KEY_METRIC_KID_MEAN, kid_features_to_metric

    size = min(1000, len(gen), len(ref))
    out = kid_features_to_metric(torch.from_numpy(gen), torch.from_numpy(ref), kid_subsets=subsets,
                                 kid_subset_size=size, rng_seed=seed, verbose=False)
    return float(out[KEY_METRIC_KID_MEAN])


def precision_recall(gen: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    from torch_fidelity.metric_prc import KEY_METRIC_PRECISION, KEY_METRIC_RECALL, prc_features_to_metric

    k = min(3, len(gen) - 1, len(ref) - 1)
    out = prc_features_to_metric(torch.from_numpy(gen).float(), torch.from_numpy(ref).float(),
                                 prc_neighborhood=k, verbose=False)
    return float(out[KEY_METRIC_PRECISION]), float(out[KEY_METRIC_RECALL])


def fidelity_metrics(gen: InceptionFeatures, ref: InceptionFeatures | None,
                     ref_stats: tuple[np.ndarray, np.ndarray] | None = None, *, paired: bool = False,
                     reps: int = 20, seed: int = 0) -> dict[str, Estimate]:
    """FID / IS / KID / precision / recall of `gen` against a reference, each with its interval.

    ref: reference features (KID and precision/recall need them; FID uses `ref_stats` when given,
    e.g. an ADM batch's precomputed mu/sigma, else the Gaussian of `ref`). paired: image i of
    `gen` and of `ref` share seed and condition (resampled together).
    """
    require_torch_fidelity()
    if len(gen) < 2:
        raise UserError("FID / KID / precision-recall need at least 2 generated images")
    if ref is not None and len(ref) < 2:
        raise UserError("FID / KID / precision-recall need at least 2 reference images")
    if paired and (ref is None or len(ref) != len(gen)):
        raise UserError("a paired reference must hold as many images as the generated set")
    width = gen.pool.shape[1]
    if ref_stats is not None and len(ref_stats[0]) != width:
        raise UserError(f"the reference's precomputed mu / sigma have {len(ref_stats[0])} features but InceptionV3's "
                        f"pool_3 has {width}; use a reference batch computed with pool_3 features (ADM's are)")
    stats = ref_stats if ref_stats is not None else (gaussian(ref.pool) if ref is not None else None)
    if stats is not None and not np.isfinite(stats[1]).all():
        raise UserError("the reference's feature covariance is not finite; no figure was computed")

    def figures(idx: np.ndarray, subsets: int) -> dict[str, float]:
        g = gen.pool[idx]
        r = ref.pool[idx] if (paired and ref is not None) else (ref.pool if ref is not None else None)
        out = {"inception_score": inception_score(gen.logits[idx])}
        if stats is not None:
            out["fid"] = fid(gaussian(g), gaussian(r) if paired and r is not None else stats)
        if r is not None:
            out["kid"] = kid(g, r, subsets=subsets, seed=seed)
            out["precision"], out["recall"] = precision_recall(g, r)
        return out

    n = len(gen)
    point = figures(np.arange(n), subsets=100)
    # a resample's KID uses 10 subsets: its spread is dominated by the resample, not the subsets
    broken = sorted(name for name, value in point.items() if not np.isfinite(value))
    if broken:
        raise UserError(f"{', '.join(broken)} came out NaN or infinite from finite features; the feature sets are "
                        "degenerate (e.g. every image identical): no figure was written")
    replicates = [figures(idx, subsets=10) for idx in bootstrap(n, reps, seed)]
    return {name: Estimate.of(value, [r[name] for r in replicates]) for name, value in point.items()}


def save_random_inception(path: str | Path, seed: int = 0) -> Path:
    """Write torch-fidelity's InceptionV3 with random weights (He-initialised convolutions, so
    features do not fade with depth) as safetensors: a stand-in for the real file in tests and
    smoke runs. Its figures mean nothing; its shapes, code path and timings are the real ones."""
    require_torch_fidelity()
    from safetensors.torch import save_file
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    class Skeleton(FeatureExtractorInceptionV3):
        def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:  # noqa: ARG002
            return None  # built without weights; they are drawn below

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Skeleton("inception-v3-compat", ["2048"], feature_extractor_weights_path=_in_memory({}))
        for module in model.modules():
            if isinstance(module, torch.nn.Conv2d):
                torch.nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return Path(path)
