"""Training of the embedded demo bundle: tokenizer, target GPT, drafter and quality classifier.

`train_demo(out_dir, DemoTrainConfig(...))` rebuilds the whole bundle from scratch on the CPU
(`runtime train demo`). Stages, each deterministic given the seed (up to the thread count's
effect on float summation order):

1. **VQ tokenizer** (`runtime.models.vq.VQModel`, small config, 4x downsample so a 64x64 image
   is a 16x16 = 256-token grid, LlamaGen-256's sequence length). Trained as a VQ-VAE on freshly
   rendered images: L1 + L2 reconstruction + the quantiser's codebook and commitment losses.
   The codebook is initialised by spherical k-means over the (untrained) encoder's outputs,
   and codes unused over a window of steps are restarted at random encoder outputs of the
   current batch during the first part of training, so nearly the whole codebook is in use.
2. **Tokenised dataset**: `n_token_images` training images (seed `seed`) and a validation set
   (seed `VAL_SEED`) encoded once with the trained tokenizer.
3. **Target** (`runtime.models.gpt.Transformer`, c2i, `GPT-demo` shape with overrides): next
   token cross-entropy, label dropout to the null class (inside the model) for CFG, AdamW with
   warm-up and cosine decay. Two choices buy sample quality within a CPU budget: the token
   embedding and output head start from the VQ codebook (`init_embeddings_from_codebook`),
   and the first half of the steps train on top-half prefixes (`train_gpt`).
4. **Drafter** (`runtime.models.drafter.Drafter`, EAGLE/LANTERN layout): teacher-forced on the
   trained target's post-norm hidden states over real tokens (10% of samples with the null
   class, so the CFG-unconditional branch is learned); embedding copied from the target and
   frozen; loss SmoothL1 + 0.1 x soft cross-entropy through the target's lm_head, uniform
   noise on the input hiddens (EAGLE's convention).
5. **Classifier** (`runtime.demo.classifier.DemoClassifier`) on freshly rendered images.

Weights of the target and drafter are stored in fp16 to keep the bundle small; every metric in
the manifest is measured after that round trip, i.e. on the weights that ship.

The modules, each importing only those listed before it:
  inputs      the progress callback type and rendered training images
  tokenizer   stages 1 and 2: the VQ tokenizer, the tokenised dataset
  target      stage 3: the target GPT
  drafter     stage 4: the drafter
  classifier  stage 5: the quality classifier
  config      `DemoTrainConfig`, the target's config, the recommended sampling settings
  evaluation  sample quality of a trained target
  runs        `train_demo`, `retrain_drafter`, `retrain_target`: the runs that write a bundle
"""

from runtime.demo.train.classifier import ClassifierTrainResult, train_classifier
from runtime.demo.train.config import RECOMMENDED_SAMPLING, DemoTrainConfig, demo_gpt_config
from runtime.demo.train.drafter import (DRAFTER_NOISE_STD, DRAFTER_NULL_CLASS_PROB, DrafterTrainResult,
                                        drafter_val_metrics, teacher_hiddens, train_drafter)
from runtime.demo.train.evaluation import sample_quality
from runtime.demo.train.inputs import Progress
from runtime.demo.train.runs import retrain_drafter, retrain_target, train_demo
from runtime.demo.train.target import GPTTrainResult, gpt_val_loss, init_embeddings_from_codebook, train_gpt
from runtime.demo.train.tokenizer import (DEMO_VQ_CONFIG, VQTrainResult, evaluate_vq, spherical_kmeans,
                                          tokenize_images, train_vq)

__all__ = [
    "ClassifierTrainResult", "DEMO_VQ_CONFIG", "DRAFTER_NOISE_STD", "DRAFTER_NULL_CLASS_PROB", "DemoTrainConfig",
    "DrafterTrainResult", "GPTTrainResult", "Progress", "RECOMMENDED_SAMPLING", "VQTrainResult",
    "demo_gpt_config", "drafter_val_metrics", "evaluate_vq", "gpt_val_loss", "init_embeddings_from_codebook",
    "retrain_drafter", "retrain_target", "sample_quality", "spherical_kmeans", "teacher_hiddens",
    "tokenize_images", "train_classifier", "train_demo", "train_drafter", "train_gpt", "train_vq",
]
