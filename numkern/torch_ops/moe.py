"""numkern's moe ops as torch custom ops (see ``_lib``)."""
