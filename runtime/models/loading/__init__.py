"""Loading and saving weights: official LlamaGen checkpoints, HF-converted LlamaGen-T2I folders,
LANTERN drafter folders and the project's own safetensors bundles.

Every problem with a user's file is a `UserError` with one line that names the file, and for
state-dict problems the key and both shapes. Pickled checkpoints are read with
`weights_only=True`; a file that needs arbitrary pickled objects (e.g. an `argparse.Namespace`
saved under "args") is refused unless the user passes `--trust-checkpoint`.

The modules, each importing only those listed before it:
  files          reading checkpoint files; JSON and safetensors writers
  strict         a state dict checked against a module, one-line errors
  hf_llamagen    HF-converted LlamaGen folders: key renames, config.json, weights
  drafter_folder LANTERN drafter folders
  bundles        the project's own bundles
  builders       the CLI's builders: GPT (at the image size its file name states), VQ, drafter
"""

from runtime.models.configs import VQ_CONFIGS
from runtime.models.loading.builders import (OFFICIAL_IMAGE_SIZES, TOKEN_PIXELS, build_drafter, build_gpt,
                                             build_vq, check_drafter_matches_target, check_image_size,
                                             checkpoint_image_size, image_size_from_name)
from runtime.models.loading.bundles import (BUNDLE_FORMAT, BUNDLE_MANIFEST, BUNDLE_VERSION, Bundle, BundlePart,
                                            read_bundle, save_bundle)
from runtime.models.loading.drafter_folder import (DRAFTER_INPUT_TYPES, drafter_config_from_json,
                                                   drafter_config_to_json, load_drafter_folder,
                                                   save_drafter_folder)
from runtime.models.loading.files import (PICKLE_SUFFIXES, SAFETENSORS_SUFFIX, TRUST_FLAG, WRAPPER_KEYS,
                                          WRAPPER_PREFIXES, read_checkpoint, read_json, write_json,
                                          write_safetensors)
from runtime.models.loading.hf_llamagen import (gpt_config_from_hf, hf_config_from_gpt, hf_llamagen_to_official,
                                                is_hf_folder, load_hf_llamagen_folder, official_to_hf_llamagen,
                                                read_hf_weights)
from runtime.models.loading.strict import check_state_dict, load_state_dict_strict

__all__ = [
    "BUNDLE_FORMAT", "BUNDLE_MANIFEST", "BUNDLE_VERSION", "Bundle", "BundlePart", "DRAFTER_INPUT_TYPES",
    "OFFICIAL_IMAGE_SIZES", "PICKLE_SUFFIXES", "SAFETENSORS_SUFFIX", "TOKEN_PIXELS", "TRUST_FLAG",
    "VQ_CONFIGS", "WRAPPER_KEYS", "WRAPPER_PREFIXES", "build_drafter", "build_gpt", "build_vq",
    "check_drafter_matches_target", "check_image_size", "check_state_dict", "checkpoint_image_size",
    "drafter_config_from_json", "drafter_config_to_json", "gpt_config_from_hf", "hf_config_from_gpt",
    "hf_llamagen_to_official", "image_size_from_name", "is_hf_folder", "load_drafter_folder",
    "load_hf_llamagen_folder", "load_state_dict_strict", "official_to_hf_llamagen", "read_bundle",
    "read_checkpoint", "read_hf_weights", "read_json", "save_bundle", "save_drafter_folder", "write_json",
    "write_safetensors",
]
