"""Test-wide settings. On CUDA the engine is compared with references run on the same GPU, so
TF32 is off and cuDNN is deterministic: the tolerances then hold on CPU and CUDA alike."""
import torch

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.backends.cudnn.deterministic = True
torch.backends.cudnn.benchmark = False
