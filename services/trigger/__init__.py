"""RelayGR trigger: sequence-aware admission of relays (arrives with the trigger issue)."""
