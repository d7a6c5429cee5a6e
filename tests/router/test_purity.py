import subprocess
import sys


def test_router_imports_neither_ray_nor_torch():
    code = ("import sys, thinkserve.router, thinkserve.router.placement, thinkserve.router.answers, thinkserve.router.consensus;"
            "bad = [m for m in ('ray', 'torch', 'grpc') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
