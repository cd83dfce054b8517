"""The tooling floor, above the services: the `relaygr` command line, the local mesh and its
drivers (tooling.local) and the simulator (tooling.sim)."""
