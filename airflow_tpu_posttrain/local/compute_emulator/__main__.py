"""Run the Compute Engine emulator standalone.

``python -m airflow_tpu_posttrain.local.compute_emulator --port 8930``. No Google behaviour of its own
(``emulator`` and the modules it names say which each part stands for).
"""

from __future__ import annotations

import argparse
import signal
import threading

from airflow_tpu_posttrain.local.compute_emulator.emulator import ComputeEmulator


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run a local Compute Engine API emulator.")
    parser.add_argument("--port", type=int, default=8930)
    parser.add_argument("--operation-seconds", type=float, default=0.2)
    parser.add_argument("--instance-ip", default="127.0.0.1")
    parser.add_argument(
        "--local-slice-vms", type=int, default=None, metavar="N",
        help="a slice's MIG makes N VMs standing for its topology's VM count (a local stand-in difference: CPU cost)",
    )
    args = parser.parse_args(argv)
    stop_requested = threading.Event()
    for signal_number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signal_number, lambda *_: stop_requested.set())
    with ComputeEmulator(
        args.port, args.operation_seconds, args.instance_ip, local_slice_vms=args.local_slice_vms
    ) as emulator:
        print(f"compute emulator listening on {emulator.url}", flush=True)
        stop_requested.wait()


if __name__ == "__main__":
    main()
