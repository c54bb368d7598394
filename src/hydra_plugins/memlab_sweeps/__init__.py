"""memlab's ready sweeps (the repo's ``sweeps/``) as the config group ``sweep``."""
