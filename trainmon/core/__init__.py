"""The ground floor: facts every other part of trainmon shares, each defined once (the record schema and op
derivation, records and families, collective names, the anomaly event, the ordering key, the run layout, the
sink table, shared defaults, the version). It imports nothing else from trainmon."""
