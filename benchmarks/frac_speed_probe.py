import time, torch
from fq.codec.viterbi import viterbi_gpu, viterbi
g = torch.Generator().manual_seed(3)
for K in (1.5, 2.5, 3.5, 2):
    for n in (512, 2048):
        x = torch.randn(n, 256, generator=g)
        viterbi_gpu(x[:8], K, "mul1", "cuda"); torch.cuda.synchronize()
        t = time.time(); s = viterbi_gpu(x, K, "mul1", "cuda"); torch.cuda.synchronize(); dt = time.time() - t
        t = time.time(); c = viterbi(x[:256], K, "mul1"); dc = time.time() - t
        print(f"K {K} n {n}: gpu {n/dt:.0f} tiles/s; cpu 16 threads {256/dc:.0f} tiles/s; equal {torch.equal(s[:256].cpu(), c)}", flush=True)
