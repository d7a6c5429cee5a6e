"""thinkserve.kvtransfer"""
