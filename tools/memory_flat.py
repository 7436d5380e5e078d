# Extra peak RSS of one pyattn attention call (B1 H8 D64, out= given) from L = 1024 to 16384:
# flat means the kernels keep no buffer that grows with L.   python tools/memory_flat.py
import subprocess
import sys

child = r"""
import sys, numpy as np, pyattn
L = int(sys.argv[1])
def st(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(key + ":"))
rng = np.random.default_rng(0)
pyattn.scaled_dot_product_attention(*(rng.standard_normal((1,1,64,64), dtype=np.float32) for _ in range(3)))
q, k, v = (rng.standard_normal((1, 8, L, 64), dtype=np.float32) for _ in range(3))
out = np.zeros_like(q); out += 1
with open("/proc/self/clear_refs", "w") as f: f.write("5")
before = st("VmRSS")
pyattn.scaled_dot_product_attention(q, k, v, out=out)
print((st("VmHWM") - before) / 1024)
"""
for L in (1024, 2048, 4096, 8192, 16384):
    r = subprocess.run([sys.executable, "-c", child, str(L)], capture_output=True, text=True)
    print(
        f"L={L}: extra peak RSS beyond inputs and out= buffer: {float(r.stdout.strip()):.2f} MiB"
        if r.returncode == 0
        else r.stderr[-500:]
    )
