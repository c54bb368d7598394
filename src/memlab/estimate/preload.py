"""What every estimate loads on first use, loaded when :mod:`memlab.estimate` is imported
instead (~3 s; the process's total is the same, and an estimate's own time is its work):
torch._dynamo (imported by the first dynamo-disable guard called), the memory tracker,
transformers' model base, auto classes, tokenizers and generation, and every option module (the
registry each configuration is validated against). Only a model type's own module (such as
``modeling_qwen2``) is left to the estimate that builds it."""

import torch._dynamo  # noqa: F401
import torch.distributed._tools.mem_tracker  # noqa: F401
import transformers.generation.utils  # noqa: F401
import transformers.masking_utils  # noqa: F401
import transformers.modeling_layers  # noqa: F401
import transformers.modeling_utils  # noqa: F401
import transformers.models.auto.modeling_auto  # noqa: F401
import transformers.models.auto.tokenization_auto  # noqa: F401
import transformers.tokenization_utils_tokenizers  # noqa: F401

from memlab import registry

registry.load_all()
