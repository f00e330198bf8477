"""Reports the CUDA stream it runs on, after real work on it."""
import torch

stream = torch.cuda.current_stream()
x = torch.randn(512, 512, device="cuda")
total = (x @ x).sum().item()
print(f"stream={stream.cuda_stream} default={stream == torch.cuda.default_stream()} ok={total == total}")
