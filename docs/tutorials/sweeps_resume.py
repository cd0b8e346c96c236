"""Tutorial 5: a sweep over a key, and a run stopped by a signal, then resumed.

Both go through the command line, as a sweep and a Slurm job do: a Hydra multirun
(`-m`) over the gradient scale of experiment=grad_scale, one job and one captures.h5 each; then
a capture run is sent SIGTERM as soon as its first rows are in the file, and the same command
with resume=true finishes it.
"""

import csv
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py

import hookrun

HOOKRUN = [sys.executable, "-m", "hookrun"]
SMALL = ["model=digits_cnn", "dataset=digits", "limit=4", "render=false"]

# 1. A sweep: one job per value, each in its own folder, a summary row per job.
sweep = Path("multirun/scales")
subprocess.run(
    [*HOOKRUN, "-m", "experiment=grad_scale", "hooks.scale.args.factor=0.5,2", *SMALL]
    + [f"hydra.sweep.dir={sweep}"],
    check=True,
)
with open(sweep / "sweep_summary.csv") as f:
    for job in csv.DictReader(f):
        print(job["overrides"], job["status"], job["rows"], job["file"])

# 2. A run stopped by SIGTERM (what Slurm sends before preempting a job) once rows are in.
run_dir = Path("outputs/killed")
command = [*HOOKRUN, "experiment=capture", "model=digits_cnn", "dataset=digits"]
command += ["limit=40", "batch_size=1", f"hydra.run.dir={run_dir}"]
process = subprocess.Popen(command)
path = run_dir / "captures.h5"
while process.poll() is None:
    try:
        with h5py.File(path, "r", swmr=True) as f:  # a file being written reads in SWMR mode
            if f.attrs.get("completed", 0) > 0:
                process.send_signal(signal.SIGTERM)
                break
    except OSError:  # not made yet, or between two writes
        pass
    time.sleep(0.05)
print("exit status", process.wait())  # 143: stopped by SIGTERM
with hookrun.open(path) as res:
    print("after the signal:", res.file.attrs["status"], res.file.attrs["completed"], "rows")

# 3. The same command with resume=true continues from the rows in the file.
subprocess.run([*command, "resume=true"], check=True)
with hookrun.open(path) as res:
    print("after the resume:", res.file.attrs["status"], res.file.attrs["completed"], "rows")
