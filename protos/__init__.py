"""thinkserve.protos"""
