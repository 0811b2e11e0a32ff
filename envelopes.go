package main

import "devicehub/internal/model"

// The API's envelopes: what every answer is wrapped in.

// newToken is a created token as answered, the only time its secret is shown.
type newToken struct {
	model.TokenInfo
	Token string `json:"token"`
}

// messageBody, deviceMessage and dataBody are the API's envelopes.
type messageBody struct {
	Message string `json:"message"`
}

type deviceMessage struct {
	Message   string `json:"message"`
	DeviceUID string `json:"device_uid"`
}

type dataBody struct {
	Data any `json:"data"`
}
