"""numkern's attention ops as torch custom ops (see ``_lib``)."""
