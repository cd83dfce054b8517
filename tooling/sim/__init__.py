"""A discrete-event simulator of the relay on a virtual clock, running the services' own policy
code: admission, placement, the KV store, the scheduler's ordering and the cost model."""
