"""Does this kernel's ext4 acknowledge an fdatasync whose data a journal abort then throws away?

The measurement behind the store's journal probe (README, "What a sync is trusted with"). Each run makes
a fresh ext4 (errors=remount-ro) on a loop device; one thread appends 8 frames of 4,120 bytes (a SQLite
log's frame size) to a file and fdatasyncs it, again and again, while another creates, fsyncs and
renames small files beside it (as a worker's --out folder does); at a random moment (seeded) an error is
triggered through /sys/fs/ext4/DEV/trigger_fs_error. After a remount, every frame whose fdatasync
returned 0 must be there. With ``--probe`` each fdatasync that returned 0 is followed by the store's
probe on another file of the filesystem, and a refused probe means that sync is not counted.

    sudo python3 tools/ext4_abort_window.py --runs 100            # without the probe
    sudo python3 tools/ext4_abort_window.py --runs 100 --probe    # with it

Needs root (mount, losetup), mkfs.ext4, and onward importable for --probe.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

FRAME = 4120
FRAMES_PER_SYNC = 8


def frame(i: int) -> bytes:
    return (b"%08d" % i) * (FRAME // 8)


def one_run(seed: int, probe: Callable[[int], bool] | None, work: Path) -> tuple[int, int, bool]:
    """(syncs acknowledged, frames of those missing after the remount, whether a probe refused)."""
    rng = random.Random(seed)
    image, mount = work / "disk.img", work / "mnt"
    image.unlink(missing_ok=True)
    with open(image, "wb") as f:
        f.truncate(32 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    device = subprocess.run(["losetup", "-f", "--show", str(image)], check=True, capture_output=True,
                            text=True).stdout.strip()
    mount.mkdir(exist_ok=True)
    try:
        subprocess.run(["mount", "-o", "errors=remount-ro", device, str(mount)], check=True)
        (mount / "out").mkdir()
        log = os.open(mount / "log", os.O_RDWR | os.O_CREAT, 0o600)
        other = os.open(mount / "db", os.O_RDWR | os.O_CREAT, 0o600)
        os.pwrite(other, b"SQLite format 3\x00" * 256, 0)
        os.fsync(other)
        acked, refused, stop = [0], [False], threading.Event()

        def append() -> None:
            n = 0
            while not stop.is_set():
                try:
                    for k in range(FRAMES_PER_SYNC):
                        i = n * FRAMES_PER_SYNC + k
                        os.pwrite(log, frame(i), i * FRAME)
                    os.fdatasync(log)
                except OSError:
                    return
                if probe is not None:
                    try:
                        probe(other)
                    except OSError:
                        refused[0] = True  # this sync is not counted as acknowledged
                        return
                n += 1
                acked[0] = n

        def create_files() -> None:
            folder = os.open(mount / "out", os.O_RDONLY)
            j = 0
            try:
                while not stop.is_set():
                    tmp = mount / "out" / f".tmp{j}"
                    with open(tmp, "wb") as f:
                        f.write(b"x" * 1500)
                        f.flush()
                        os.fsync(f.fileno())
                    os.rename(tmp, mount / "out" / f"r{j}")
                    os.fsync(folder)
                    j += 1
            except OSError:
                pass
            finally:
                os.close(folder)

        threads = [threading.Thread(target=append), threading.Thread(target=create_files)]
        for t in threads:
            t.start()
        time.sleep(rng.uniform(0.01, 0.2))
        Path(f"/sys/fs/ext4/{Path(device).name}/trigger_fs_error").write_text("1")
        time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join()
        os.close(log)
        os.close(other)
        subprocess.run(["umount", str(mount)], check=True)
        subprocess.run(["mount", device, str(mount)], check=True)
        data = (mount / "log").read_bytes()
        frames = acked[0] * FRAMES_PER_SYNC
        missing = sum(data[i * FRAME:(i + 1) * FRAME] != frame(i) for i in range(frames))
        return acked[0], missing, refused[0]
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
        subprocess.run(["losetup", "-d", device], capture_output=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1, help="seed of the first run (the next ones count up)")
    parser.add_argument("--probe", action="store_true", help="follow each fdatasync with the store's probe")
    args = parser.parse_args()
    probe = None
    if args.probe:
        from onward.store.sqlite import journal_probe
        probe = journal_probe
    lost_runs = refusals = 0
    with tempfile.TemporaryDirectory() as work:
        for seed in range(args.seed, args.seed + args.runs):
            acked, missing, refused = one_run(seed, probe, Path(work))
            lost_runs += missing > 0
            refusals += refused
            print(f"seed={seed} acknowledged syncs={acked} frames of them missing={missing} probe refused={refused}")
    print(f"{args.runs} runs, probe {'on' if args.probe else 'off'}: acknowledged data lost in {lost_runs} "
          f"run(s); a probe refused in {refusals}")
    return 1 if lost_runs else 0


if __name__ == "__main__":
    sys.exit(main())
