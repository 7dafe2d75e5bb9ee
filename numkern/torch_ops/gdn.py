"""numkern's gdn ops as torch custom ops (see ``_lib``)."""
