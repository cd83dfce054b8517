"""What the etcd client raises besides `Unavailable`: a refused request, refused credentials."""

from relaygr.errors import ConfigError, RelayGRError


class EtcdRejected(RelayGRError):
    """etcd answered but refused the request (e.g. its lease expired); a plain retry won't help."""


class EtcdAuthFailed(ConfigError):
    """etcd refused this client's user name or password: the configuration must change."""
