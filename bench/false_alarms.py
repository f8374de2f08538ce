"""What a false alarm costs: the default guard on a run that makes no progress, with noisy gradient norms.

A guard attached to a trained model (or a run on a plateau) sees a flat loss and global gradient norms that
vary from step to step. With a few norms seen, the early rules (``instability_overshoot``) cannot tell a
noisy norm from an overshoot, so they sometimes begin an instability and the LR factor (``instability_lr``)
cuts the LR. This measures how often, and how much LR it costs: the default guard over a two-layer model
whose gradients are set by hand each step (i.i.d. Gaussian, scaled by a lognormal factor of spread
``sigma``), the loss 4 + N(0, 0.05^2) (``--loss flat``; ``noisy``: 4 x a lognormal factor of spread 0.3 of
its own; ``coupled``: 4 x the norm's own factor, a hard batch raising both, the worst case for the rules
that need a rise of both), for ``--steps`` steps and ``--seeds`` seeds per sigma. No training
happens that matters (SGD at LR 1 on random gradients): the LR the guard gave each step is read from its
flight recorder (1.0 = the LR in full).

Reported per sigma: the seeds with at least one step below the full LR, and over those, the mean and
largest LR lost, in steps' worth (the sum over the run of 1 - factor), and the mean and largest number of
steps taken below the full LR. A long loss comes from a second alarm within the memory of the first (a
relapse: the fixed drop and a linear way back).

Usage:
  python bench/false_alarms.py                          # sigma 0.1 0.2 0.3 0.5, 200 seeds, 200 steps
  python bench/false_alarms.py --sigmas 0.3 --seeds 50
  python bench/false_alarms.py --loss coupled           # the loss moves with the norm
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import sys
from typing import Dict, List

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from stabilityguard import GuardedOptimizer  # noqa: E402


#: The loss of one step, from the step's norm factor and the run's random numbers (see the module doc).
LOSSES = {
    "flat": lambda rng, scale: 4.0 + 0.05 * rng.gauss(0.0, 1.0),
    "noisy": lambda rng, scale: 4.0 * math.exp(0.3 * rng.gauss(0.0, 1.0)),
    "coupled": lambda rng, scale: 4.0 * scale,
}


def lr_factors(seed: int, sigma: float, steps: int, loss: str = "flat") -> List[float]:
    """The LR the default guard gave each step of one run that makes no progress (its flight recorder's
    ``lr``, base LR 1); ``loss``: a key of :data:`LOSSES`."""
    make_loss = LOSSES[loss]
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), model, verbose=False, log_dir=None,
                           flight_recorder_steps=steps)
    for _ in range(steps):
        scale = math.exp(rng.gauss(0.0, sigma))
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 0.1 * scale
        opt.step(loss=torch.tensor(make_loss(rng, scale)))
    rows = opt.state_dict()["stabilityguard"]["recorder"]["rows"]
    opt.close()
    return [float(row[3]) for row in rows]


def measure(sigma: float, seeds: int, steps: int, loss: str = "flat") -> Dict[str, float]:
    """Alarmed seeds and the LR they lost, for one sigma."""
    lost: List[float] = []
    below: List[int] = []
    for seed in range(seeds):
        lr = lr_factors(seed, sigma, steps, loss)
        if min(lr) < 1.0:
            lost.append(sum(1.0 - x for x in lr))
            below.append(sum(x < 1.0 for x in lr))
    n = len(lost)
    return {"sigma": sigma, "alarmed": n, "seeds": seeds,
            "lost_mean": sum(lost) / n if n else 0.0, "lost_max": max(lost, default=0.0),
            "below_mean": sum(below) / n if n else 0.0, "below_max": max(below, default=0)}


def main(argv: List[str] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sigmas", nargs="*", type=float, default=[0.1, 0.2, 0.3, 0.5])
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--steps", type=int, default=200, help="steps per run (a relapse's way back is 100)")
    ap.add_argument("--loss", choices=sorted(LOSSES), default="flat", help="the loss of each step (default flat)")
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}; {args.seeds} seeds x {args.steps} steps per sigma, loss {args.loss}; "
          "LR lost in steps' worth")
    print("| sigma | seeds with an alarm | LR lost, mean (max) | steps below the full LR, mean (max) |")
    print("|---:|---:|---:|---:|")
    logging.disable(logging.WARNING)  # the guard's own warnings, for the measurement only
    try:
        for sigma in args.sigmas:
            r = measure(sigma, args.seeds, args.steps, args.loss)
            print(f"| {sigma:g} | {r['alarmed']} of {r['seeds']} | {r['lost_mean']:.2f} ({r['lost_max']:.2f}) | "
                  f"{r['below_mean']:.1f} ({r['below_max']}) |")
    finally:
        logging.disable(logging.NOTSET)


if __name__ == "__main__":
    main()
