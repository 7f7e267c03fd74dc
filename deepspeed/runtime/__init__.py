"""`deepspeed.runtime`: upstream's import path; each submodule re-exports deepspeed_ext."""
