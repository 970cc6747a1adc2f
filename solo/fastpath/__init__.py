"""The fast path: what turns the loaded reference model into the configuration that runs."""

from solo.fastpath.accelerate import BLOCK_FP8_MODES, FastPathOptions, accelerate, keep_block_fp8, load_accelerated

__all__ = ["BLOCK_FP8_MODES", "FastPathOptions", "accelerate", "keep_block_fp8", "load_accelerated"]
