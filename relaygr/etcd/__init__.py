"""etcd: security settings, the failover client, kept leases, watches, membership and directory."""
