"""Executors run the steps the scheduler plans: a real model (`torch`) or a cost model."""
