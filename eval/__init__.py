"""The benchmarks and load tools (`eval.bench`, a module per `continuum bench` command) and what
they share: workloads, arrivals, metrics, reports, the replay client, the simulator, the server
subprocess, the load clients and the checks run on a server after a load."""
