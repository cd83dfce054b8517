"""The full gRPC names of the three services, as their contracts (protos/relaygr/v1) declare
them: the one spelling that health, reflection, authorization and callers of replicas use.
Written out rather than read from the generated modules, so that pure cores (authorization)
reach no wire code; tests/unit/test_protos.py holds them to the contracts."""

RANKER = "relaygr.v1.RankerService"
ROUTER = "relaygr.v1.RouterService"
TRIGGER = "relaygr.v1.TriggerService"
