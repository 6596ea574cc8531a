"""sluice.ipc"""
