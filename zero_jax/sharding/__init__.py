"""Where arrays live: device meshes, logical axis rules, the ZeRO stage table
and the PartitionSpec helpers they share."""
