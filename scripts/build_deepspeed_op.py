"""Build DeepSpeed's CPU shared-memory comm op once (see scripts/dev.sh setup for why and where).

Removes the stale lock of a killed build first; does nothing when the op is built and up to date
for the ninja on PATH. Run with DS_ACCELERATOR=cpu.
"""
import glob, os, subprocess, sys, time
if sys.platform != "linux":  # the op is Linux-only (ShareMemCommBuilder.is_compatible), as is /proc
    sys.exit(0)
from torch.utils.cpp_extension import _get_build_directory  # where cpp_extension.load builds
name = "deepspeed_shm_comm"
build = _get_build_directory(name, verbose=False)
lock = os.path.realpath(os.path.join(build, "lock"))

def lock_held():  # open in a live process: a build is running
    for fd in glob.glob("/proc/[0-9]*/fd/*"):
        try:
            if os.readlink(fd) == lock:
                return True
        except OSError:
            pass
    return False

if os.path.exists(lock) and not lock_held():
    time.sleep(1)  # not a builder caught between closing the lock and removing it
    if os.path.exists(lock) and not lock_held():
        print(f"removing the stale lock of a killed build: {lock}")
        os.remove(lock)
try:  # no ninja at all: DeepSpeed's load below says so
    dry_run = subprocess.run(["ninja", "-n", "-C", build], capture_output=True, text=True).stdout
except OSError:
    dry_run = ""
if os.path.exists(os.path.join(build, name + ".so")) and not os.path.exists(lock) and "no work to do" in dry_run:
    sys.exit(0)  # built, and up to date for this ninja
import deepspeed.ops
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
    sys.exit(0)  # DeepSpeed falls back to plain gloo here: nothing to build
print(f"building DeepSpeed's {name} op (a few minutes, once; or waiting for a running build) in {build}",
      flush=True)
start = time.time()
builder.load(verbose=False)  # waits, if another process is building it right now
print(f"built {name} in {time.time() - start:.0f} s")
