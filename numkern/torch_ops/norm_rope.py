"""numkern's norm_rope ops as torch custom ops (see ``_lib``)."""
