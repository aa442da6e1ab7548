package orders_test

import (
	"os"
	"testing"

	"github.com/orderconfirm/inboxd/internal/testenv"
)

func TestMain(m *testing.M) {
	code := m.Run()
	testenv.Stop()
	os.Exit(code)
}
