def low_stock(store, threshold):
    return [sku for sku, item in store.items.items() if item.quantity <= threshold]
