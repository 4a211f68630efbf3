"""The runs that write a demo bundle: `train_demo` (every part from scratch), `retrain_drafter`
(a new drafter for a bundle's frozen target) and `retrain_target` (a target of another shape on
a bundle's tokens)."""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

from runtime.demo.dataset import CLASS_NAMES, IMAGE_SIZE, NUM_CLASSES, VAL_SEED
from runtime.demo.train.classifier import train_classifier
from runtime.demo.train.config import RECOMMENDED_SAMPLING, DemoTrainConfig, demo_gpt_config
from runtime.demo.train.drafter import drafter_val_metrics, train_drafter
from runtime.demo.train.evaluation import sample_quality
from runtime.demo.train.inputs import Progress, no_progress
from runtime.demo.train.target import GPTTrainResult, gpt_val_loss, init_embeddings_from_codebook, train_gpt
from runtime.demo.train.tokenizer import tokenize_images, train_vq
from runtime.models.vq import VQModel

def _n_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _train_target_and_drafter(cfg: DemoTrainConfig, vq: VQModel, tokens: torch.Tensor, labels: torch.Tensor,
                              val_tokens: torch.Tensor, val_labels: torch.Tensor, progress: Progress
                              ) -> tuple["Transformer", GPTTrainResult, "Drafter", Any]:
    """The target (`cfg`'s shape, embeddings from `vq`'s codebook) and then its drafter, each
    trained and passed through the fp16 storage round trip, so later metrics see shipped weights.
    Draws from the global RNG as it stands (the caller seeds it)."""
    from runtime.demo.bundle import round_trip_
    from runtime.models.configs import DrafterConfig
    from runtime.models.drafter import Drafter
    from runtime.models.gpt import Transformer

    gpt_cfg = demo_gpt_config(cfg)
    gpt = Transformer(gpt_cfg)
    gpt.init_weights()
    init_embeddings_from_codebook(gpt, vq.codebook_vectors(), torch.Generator().manual_seed(cfg.seed + 1))
    gpt_res = train_gpt(gpt, tokens, labels, val_tokens, val_labels, steps=cfg.steps_gpt, batch=cfg.batch_gpt,
                        seed=cfg.seed, progress=progress)
    round_trip_(gpt, "gpt")
    drafter = Drafter(DrafterConfig.for_target(gpt_cfg))
    drafter_res = train_drafter(drafter, gpt, tokens, labels, val_tokens[:64], val_labels[:64],
                                steps=cfg.steps_drafter, batch=cfg.batch_drafter, seed=cfg.seed, progress=progress)
    round_trip_(drafter, "drafter")
    return gpt, gpt_res, drafter, drafter_res


def _source_tokens(model_dir: str | None, threads: int, progress: Progress) -> tuple[Any, int, int, torch.Tensor,
                                                                                       torch.Tensor]:
    """Load a bundle and re-tokenise its training data with its own VQ: (bundle, train seed,
    image count, tokens (N, 256), labels (N,)), the same tokens its target was trained on."""
    from runtime.demo.bundle import load_demo_bundle

    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    bundle = load_demo_bundle(model_dir)
    data = bundle.manifest.get("training", {}).get("data", {})
    train_seed = int(data.get("train_seed", 0))
    n_images = int(data.get("n_token_images", DemoTrainConfig().n_token_images))
    tokens, labels = tokenize_images(bundle.vq, train_seed, n_images, progress=progress)
    return bundle, train_seed, n_images, tokens, labels


def train_demo(out_dir: str, cfg: DemoTrainConfig, *, command: str, overwrite: bool = False,
               progress: Progress = no_progress) -> dict[str, Any]:
    """Train every part and write the bundle to `out_dir` (atomically). Returns the manifest."""
    from runtime.demo.bundle import save_demo_bundle
    from runtime.demo.classifier import ClassifierConfig, DemoClassifier
    from runtime.demo.dataset import dataset_hash

    t_start = time.perf_counter()
    torch.set_num_threads(cfg.threads)
    # Denormal arithmetic is orders of magnitude slower on x86; tiny gradients hit it.
    torch.set_flush_denormal(True)
    torch.manual_seed(cfg.seed)
    wall: dict[str, float] = {}

    vq = VQModel(cfg.vq).to(memory_format=torch.channels_last)
    vq_res = train_vq(vq, steps=cfg.steps_vq, batch=cfg.batch_vq, seed=cfg.seed, progress=progress)
    wall["vq"] = vq_res.seconds

    t = time.perf_counter()
    tokens, labels = tokenize_images(vq, cfg.seed, cfg.n_token_images, progress=progress)
    val_tokens, val_labels = tokenize_images(vq, VAL_SEED, cfg.n_val_images, progress=progress,
                                             stage="tokenize")
    wall["tokenize"] = time.perf_counter() - t

    gpt, gpt_res, drafter, drafter_res = _train_target_and_drafter(cfg, vq, tokens, labels, val_tokens,
                                                                   val_labels, progress)
    wall["gpt"], wall["drafter"] = gpt_res.seconds, drafter_res.seconds
    gpt_val_shipped = gpt_val_loss(gpt, val_tokens, val_labels)
    drafter_shipped = drafter_val_metrics(drafter, gpt, val_tokens[:64], val_labels[:64])

    classifier = DemoClassifier(ClassifierConfig(num_classes=NUM_CLASSES, image_size=IMAGE_SIZE))
    classifier = classifier.to(memory_format=torch.channels_last)
    cls_res = train_classifier(classifier, steps=cfg.steps_classifier, batch=cfg.batch_classifier,
                               seed=cfg.seed, progress=progress)
    wall["classifier"] = cls_res.seconds

    t = time.perf_counter()
    progress("evaluate", 0, 1, {})
    quality = sample_quality(gpt, vq, classifier, n=cfg.n_sample_images, seed=cfg.seed, n_real=cfg.n_real_images,
                             sampling=RECOMMENDED_SAMPLING)
    data_hash = dataset_hash(cfg.seed, cfg.n_token_images)
    progress("evaluate", 1, 1, {})
    wall["evaluate"] = time.perf_counter() - t
    wall["total"] = time.perf_counter() - t_start

    manifest: dict[str, Any] = {
        "name": "demo",
        "description": "LlamaGen-architecture c2i demo: procedural 64x64 shapes/patterns/textures, "
                       "16x16 VQ tokens, EAGLE/LANTERN drafter, quality classifier",
        "image_size": IMAGE_SIZE,
        "downsample": cfg.vq.downsample,
        "num_classes": NUM_CLASSES,
        "class_names": list(CLASS_NAMES),
        "recommended": dict(RECOMMENDED_SAMPLING),
        "params": {"gpt": _n_params(gpt), "vq": _n_params(vq), "drafter": _n_params(drafter),
                   "classifier": _n_params(classifier)},
        "training": {
            "command": command,
            "seed": cfg.seed,
            "config": cfg.to_dict(),
            "torch": torch.__version__,
            "data": {"generator": "runtime.demo.dataset", "train_seed": cfg.seed, "val_seed": VAL_SEED,
                     "n_token_images": cfg.n_token_images,
                     "sha256_first_n_token_images": data_hash},
            "vq_method": "VQ-VAE (L1 + L2 reconstruction + codebook + 0.25 x commitment losses); codebook "
                         "initialised by spherical k-means over the encoder's outputs; codes unused for 25 "
                         "steps restarted at random encoder outputs during the first 70% of steps",
            "gpt_method": "next-token cross-entropy; tok_embeddings and output head initialised from the VQ "
                          "codebook through a random projection (near-identical codes start near-identical); "
                          "first half of the steps on top-half prefixes at twice the batch; AdamW (0.9, 0.95), "
                          "warm-up + cosine; label dropout 0.1 for CFG",
            "drafter_method": "teacher-forced target hiddens over real tokens (10% null class); SmoothL1 + "
                              "0.1 x soft CE via the target lm_head; uniform input noise std 0.2 (EAGLE); "
                              "embed_tokens copied from the target and frozen",
            "steps": {"vq": cfg.steps_vq, "gpt": cfg.steps_gpt, "drafter": cfg.steps_drafter,
                      "classifier": cfg.steps_classifier},
            "wall_time_s": {k: round(v, 1) for k, v in wall.items()},
        },
        "metrics": {
            "vq": {"recon_l1": vq_res.recon_l1, "recon_mse": vq_res.recon_mse,
                   "codebook_usage": vq_res.codebook_usage},
            "gpt": {"train_loss": gpt_res.train_loss, "val_loss": gpt_val_shipped,
                    "val_loss_fp32": gpt_res.val_loss},
            "drafter": {"top1_vs_target": drafter_shipped["top1_vs_target"], "vloss": drafter_shipped["vloss"],
                        "ploss": drafter_shipped["ploss"]},
            "classifier": {"val_accuracy": cls_res.val_accuracy},
            "quality": quality,
        },
    }
    save_demo_bundle(out_dir, gpt=gpt, vq=vq, drafter=drafter, classifier=classifier, manifest=manifest,
                     overwrite=overwrite)
    return manifest


def retrain_drafter(model_dir: str | None, out_dir: str, *, steps: int, seed: int = 0, threads: int = 2,
                    batch: int = 16, lr: float = 1e-3, command: str, overwrite: bool = False,
                    progress: Progress = no_progress) -> dict[str, Any]:
    """Train a fresh drafter for an existing bundle's frozen target and write the bundle with it.

    The training data are the bundle's own: the first `n_token_images` images of its training
    seed, tokenised by its VQ (the same tokens `train_demo` trained the target on). The VQ,
    target and classifier are copied unchanged; the manifest keeps the original training
    record and gains `training.drafter_retrain` (command, steps, wall time, metrics before).
    Deterministic for a given seed and thread count. Returns the new manifest.
    """
    from runtime.demo.bundle import round_trip_, save_demo_bundle
    from runtime.models.configs import DrafterConfig
    from runtime.models.drafter import Drafter

    t0 = time.perf_counter()
    bundle, train_seed, n_images, tokens, labels = _source_tokens(model_dir, threads, progress)
    val_tokens, val_labels = tokenize_images(bundle.vq, VAL_SEED, 64, progress=progress, stage="tokenize")
    before = drafter_val_metrics(bundle.drafter, bundle.gpt, val_tokens, val_labels)
    torch.manual_seed(seed + 1)
    drafter = Drafter(DrafterConfig.for_target(bundle.gpt.config))
    result = train_drafter(drafter, bundle.gpt, tokens, labels, val_tokens, val_labels, steps=steps,
                           batch=batch, seed=seed, lr=lr, progress=progress)
    round_trip_(drafter, "drafter")
    after = drafter_val_metrics(drafter, bundle.gpt, val_tokens, val_labels)

    manifest = copy.deepcopy(bundle.manifest)
    manifest.pop("storage_dtypes", None)
    manifest["metrics"]["drafter"] = after
    manifest.setdefault("training", {})["drafter_retrain"] = {
        "command": command, "steps": steps, "batch": batch, "lr": lr, "seed": seed, "threads": threads,
        "data": {"train_seed": train_seed, "n_token_images": n_images},
        "wall_time_s": round(time.perf_counter() - t0, 1), "drafter_seconds": round(result.seconds, 1),
        "metrics_before": before,
    }
    save_demo_bundle(out_dir, gpt=bundle.gpt, vq=bundle.vq, drafter=drafter, classifier=bundle.classifier,
                     manifest=manifest, overwrite=overwrite)
    return manifest


def retrain_target(model_dir: str | None, out_dir: str, *, layers: int, dim: int, heads: int, steps: int,
                   steps_drafter: int, seed: int = 0, threads: int = 2, command: str, overwrite: bool = False,
                   progress: Progress = no_progress) -> dict[str, Any]:
    """Train a new target of another shape, and a drafter for it, on an existing bundle's tokens.

    The VQ, the training data (the bundle's own tokens, as `retrain_drafter` reads them) and
    the classifier are kept, so only the target's shape changes: quality and speed of the
    result compare directly with the source bundle's. The target and drafter are trained by
    the same recipe as in `train_demo`; the manifest keeps the source's record and gains
    `training.target_retrain` (command, shape, steps, wall time, the source's metrics).
    """
    from runtime.demo.bundle import save_demo_bundle

    t0 = time.perf_counter()
    bundle, train_seed, n_images, tokens, labels = _source_tokens(model_dir, threads, progress)
    source_cfg = bundle.manifest.get("training", {}).get("config", {})
    sizes = {k: int(source_cfg[k]) for k in ("n_val_images", "n_sample_images", "n_real_images", "batch_gpt",
                                             "batch_drafter") if k in source_cfg}
    cfg = DemoTrainConfig(seed=seed, threads=threads, steps_gpt=steps, steps_drafter=steps_drafter,
                          gpt_layers=layers, gpt_dim=dim, gpt_heads=heads, vq=bundle.vq.config, **sizes)
    val_tokens, val_labels = tokenize_images(bundle.vq, VAL_SEED, cfg.n_val_images, progress=progress,
                                             stage="tokenize")
    wall = {"tokenize": time.perf_counter() - t0}

    torch.manual_seed(seed)
    gpt, gpt_res, drafter, drafter_res = _train_target_and_drafter(cfg, bundle.vq, tokens, labels, val_tokens,
                                                                   val_labels, progress)
    wall["gpt"], wall["drafter"] = gpt_res.seconds, drafter_res.seconds

    t = time.perf_counter()
    progress("evaluate", 0, 1, {})
    quality = sample_quality(gpt, bundle.vq, bundle.classifier, n=cfg.n_sample_images, seed=seed,
                             n_real=cfg.n_real_images, sampling=RECOMMENDED_SAMPLING)
    progress("evaluate", 1, 1, {})
    wall["evaluate"] = time.perf_counter() - t
    wall["total"] = time.perf_counter() - t0

    manifest = copy.deepcopy(bundle.manifest)
    manifest.pop("storage_dtypes", None)
    source_metrics = {k: manifest["metrics"].get(k) for k in ("gpt", "drafter", "quality")}
    manifest["params"]["gpt"] = _n_params(gpt)
    manifest["params"]["drafter"] = _n_params(drafter)
    manifest["metrics"]["gpt"] = {"train_loss": gpt_res.train_loss,
                                  "val_loss": gpt_val_loss(gpt, val_tokens, val_labels),
                                  "val_loss_fp32": gpt_res.val_loss}
    manifest["metrics"]["drafter"] = drafter_val_metrics(drafter, gpt, val_tokens[:64], val_labels[:64])
    manifest["metrics"]["quality"] = quality
    manifest.setdefault("training", {}).pop("drafter_retrain", None)
    manifest["training"]["target_retrain"] = {
        "command": command, "shape": {"layers": layers, "dim": dim, "heads": heads},
        "steps": {"gpt": steps, "drafter": steps_drafter}, "seed": seed, "threads": threads,
        "data": {"train_seed": train_seed, "n_token_images": n_images},
        "wall_time_s": {k: round(v, 1) for k, v in wall.items()},
        "source_metrics": source_metrics,
    }
    save_demo_bundle(out_dir, gpt=gpt, vq=bundle.vq, drafter=drafter, classifier=bundle.classifier,
                     manifest=manifest, overwrite=overwrite)
    return manifest
