"""DSpark, DFlash and EAGLE-3 drafters behind one interface (base.Drafter); build_drafter picks the class."""
from __future__ import annotations

import torch

from dspark.drafters.base import DraftBlock, Drafter
from dspark.drafters.config import DrafterConfig
from dspark.drafters.dflash import DFlashDrafter
from dspark.drafters.dspark import DSparkDrafter
from dspark.drafters.eagle3 import Eagle3Drafter

_CLASSES = {"dspark": DSparkDrafter, "dflash": DFlashDrafter, "eagle3": Eagle3Drafter}


def build_drafter(cfg: DrafterConfig, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                  draft_vocab: torch.Tensor | None = None) -> Drafter:
    """A freshly initialised drafter of cfg.kind sharing the target's embedding and LM head."""
    return _CLASSES[cfg.kind](cfg, embed_weight, lm_head_weight, draft_vocab)


__all__ = ["DraftBlock", "Drafter", "DrafterConfig", "DSparkDrafter", "DFlashDrafter", "Eagle3Drafter",
           "build_drafter"]
