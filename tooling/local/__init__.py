"""Local tooling above the services: the one-machine mesh, etcd, certificates, drivers, demo."""
